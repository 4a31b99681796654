"""A phase: mix (its seeded draw of datasets), plan (what it will do), train (the launch)."""
