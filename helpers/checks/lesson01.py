"""Lesson 01's checks (to be written)."""

__all__: list[str] = []
