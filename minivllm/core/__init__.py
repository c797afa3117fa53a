"""Pure-Python request state and scheduling: no torch is imported anywhere in this package."""
