"""Lesson 02's checks (to be written)."""

__all__: list[str] = []
