"""Lesson 07's checks (to be written)."""

__all__: list[str] = []
