"""Model architectures beyond the article's FFN toy (normexp/model.py): `transformer.py`."""
