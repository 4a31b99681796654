"""Stage names as the dashboard and the CLI show them, as the DAG in DESIGN.md names them.

Keyed by stage folder, in DAG order. No Prefect import here: `sdpipe status` answers in well
under a second.
"""

DISPLAY = {
    "metadata": "fetch-metadata",
    "filtered": "filter",
    "prefetch": "prefetch-dedup",
    "shards": "fetch-images",
    "scores": "score",
    "selected": "filter-pixels",
    "views": "views",
    "tokens": "tokenize",
    "hf": "hf-export",
    "latents": "encode",
}
