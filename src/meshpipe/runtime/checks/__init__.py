"""Calls agree: every pp rank was given the same call, shapes and input values."""
