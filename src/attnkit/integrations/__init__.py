"""Integrations of attnkit with other libraries (import the one you need)."""
