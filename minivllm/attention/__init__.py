"""Attention backends behind one interface; metadata travels in a forward context."""
