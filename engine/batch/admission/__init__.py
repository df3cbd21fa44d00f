"""A request's way into the running rows: from the best prefix at hand, or after the row
that prefills the prefix it shares (`prefixes.py`; which one: `sharing.py`, pure)."""
