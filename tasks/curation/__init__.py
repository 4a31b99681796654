"""Curation: filter (metadata, pixels), score, dedup (near, semantic), waterfall, views."""
