"""FX rewrite passes; manager.py holds the ordered registry."""
