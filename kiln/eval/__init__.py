"""Accuracy evaluation of built engines (``kiln eval``)."""
