"""Examples, the offline demo and the tiny models they and the tests use (not part of the library wheel)."""
