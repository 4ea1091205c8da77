"""Bounded waits, who waits for whom, who failed first, and how every rank learns a step failed."""
