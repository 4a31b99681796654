"""Sources and fetch: fetch-metadata, the demo source, fetch-images, archive/folder adapters."""
