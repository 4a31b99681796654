"""The catalog: typed sources, filter profiles, datasets, phases and models, read from YAML."""

from catalog.loader import Catalog, CatalogError, catalog_dir, load_catalog, needs_flips
from catalog.schema import (
    Dataset,
    EvalCategory,
    EvalSet,
    FilterProfile,
    Finetune,
    MixEntry,
    Model,
    Phase,
    Source,
)

__all__ = [
    "Catalog",
    "CatalogError",
    "Dataset",
    "EvalCategory",
    "EvalSet",
    "FilterProfile",
    "Finetune",
    "MixEntry",
    "Model",
    "Phase",
    "Source",
    "catalog_dir",
    "load_catalog",
    "needs_flips",
]
