"""Async saves: a consistent snapshot into reused host buffers at the update boundary, and the
generation persisted in the background from it."""
