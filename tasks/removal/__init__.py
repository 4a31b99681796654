"""Take it back: a removal list applied to every output of a source already built."""
