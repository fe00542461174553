"""Lesson 06's checks (to be written)."""

__all__: list[str] = []
