"""The shipped catalog holds the recipe, and a broken catalog fails in one line naming file,
field and value."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from catalog import CatalogError, load_catalog
from catalog.loader import PACKAGED_DIR


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(PACKAGED_DIR)


SOURCES = ["laion", "diffusiondb", "journeydb", "vggface2", "coco", "local", "demo"]

# The recipe (seed 003): phase -> (dataset counts, peak lr, warmup steps, cfg dropout).
RECIPE = {
    "phase-1": ({"laion-broad": 1_315_411}, 1e-5, 500, 0.05),
    "phase-2": ({"laion-hq": 213_458}, 1e-5, 500, 0.05),
    "phase-3": ({"diffusiondb": 205_000, "journeydb": 277_000}, 1e-5, 500, 0.05),
    "phase-4": ({"vggface2": 51_786}, 2e-6, 200, 0.15),
    "phase-5": ({"coco-people": 59_494}, 1.5e-6, 150, 0.15),
    "phase-6": ({"laion-hq": 150_000, "vggface2": 50_000, "coco-people": 58_000}, 1e-6, 100, 0.15),
    "phase-7": (
        {
            "laion-hq": 213_000,
            "diffusiondb": 106_000,
            "journeydb": 144_000,
            "vggface2": 51_000,
            "coco-people": 58_000,
        },
        1e-6,
        150,
        0.15,
    ),
}


def test_shipped_catalog_has_every_source_and_phase(catalog):
    assert sorted(catalog.sources) == sorted(SOURCES)
    assert sorted(catalog.phases) == sorted([*RECIPE, "demo"])


@pytest.mark.parametrize("name", list(RECIPE))
def test_phase_is_the_recipe(catalog, name):
    counts, lr, warmup_steps, cfg_dropout = RECIPE[name]
    phase = catalog.phase(name)
    assert {m.dataset: m.count for m in phase.mix} == counts
    assert (phase.lr, phase.warmup_steps, phase.cfg_dropout) == (lr, warmup_steps, cfg_dropout)
    assert phase.min_snr_gamma == 5.0
    assert phase.model == "sd15"


def test_phase_1_trains_ten_epochs_from_scratch(catalog):
    phase = catalog.phase("phase-1")
    assert phase.epochs == 10
    assert phase.init_from is None


def test_phase_7_totals_572k(catalog):
    assert sum(m.count for m in catalog.phase("phase-7").mix) == 572_000


@pytest.mark.parametrize("n", range(2, 8))
def test_each_phase_starts_from_the_previous_one(catalog, n):
    assert catalog.phase(f"phase-{n}").init_from == f"phase-{n - 1}"


def test_phase_number_and_name_are_the_same_phase(catalog):
    assert catalog.phase("3") == catalog.phase("phase-3")
    assert catalog.phase("3").name == "phase-3"


def test_every_phase_draws_from_datasets_over_known_sources(catalog):
    for phase in catalog.phases.values():
        for entry in phase.mix:
            assert catalog.dataset(entry.dataset).source in catalog.sources


# ---- a broken catalog --------------------------------------------------------------------


def replace_once(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not unique in {path.name}"
    path.write_text(text.replace(old, new))


def edit_entry(path: Path, entry: str, old: str, new: str) -> None:
    """Replace `old` with `new` inside the block of one top-level YAML entry."""
    text = path.read_text()
    start = text.index(f"\n{entry}:\n") + 1
    end = re.compile(r"^\S", re.M).search(text, start + len(entry) + 2)
    end = end.start() if end else len(text)
    block = text[start:end]
    assert block.count(old) == 1, f"{old!r} is not unique in {entry}"
    path.write_text(text[:start] + block.replace(old, new) + text[end:])


def catalog_error(directory: Path) -> str:
    with pytest.raises(CatalogError) as info:
        load_catalog(directory)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_invalid_yaml_names_the_file_and_line(catalog_copy):
    path = catalog_copy / "phases.yaml"
    edit_entry(path, "phase-3", "  epochs: 5\n", "  epochs: [5\n")
    broken_line = path.read_text().splitlines().index("  epochs: [5") + 1
    message = catalog_error(catalog_copy)
    assert "phases.yaml" in message
    assert "not valid YAML" in message
    # The parser reports where it gave up: at or after the broken line, never before it.
    assert int(re.search(r"\(line (\d+)\)", message).group(1)) >= broken_line


def test_a_setting_written_twice_is_refused_naming_the_file_line_and_key(catalog_copy):
    """Plain YAML keeps the last of two equal keys: a setting added beside one already there
    (the tiny model's `buckets:`) would silently not take effect."""
    path = catalog_copy / "models.yaml"
    edit_entry(path, "tiny", "  resolution: 64\n", "  resolution: 64\n  resolution: 128\n")
    line = path.read_text().splitlines().index("  resolution: 128") + 1
    message = catalog_error(catalog_copy)
    assert "models.yaml" in message and "'resolution' is written twice" in message
    assert f"(line {line})" in message


def test_wrong_type_names_file_field_and_value(catalog_copy):
    edit_entry(catalog_copy / "phases.yaml", "phase-3", "  lr: 1.0e-5\n", '  lr: "fast"\n')
    message = catalog_error(catalog_copy)
    assert "phases.yaml" in message
    assert "phase-3.lr" in message
    assert "'fast'" in message


def test_unknown_field_names_file_field_and_allowed_fields(catalog_copy):
    edit_entry(
        catalog_copy / "phases.yaml",
        "phase-3",
        "  lr: 1.0e-5\n",
        "  learning_rate: 1.0e-5\n  lr: 1.0e-5\n",
    )
    message = catalog_error(catalog_copy)
    assert "phases.yaml" in message
    assert "phase-3.learning_rate" in message
    assert "unknown field" in message
    assert "warmup_steps" in message  # what the user may have meant is listed


def test_unknown_field_in_a_mix_entry_is_located(catalog_copy):
    edit_entry(catalog_copy / "phases.yaml", "phase-1", "count: 1315411", "cuont: 1315411")
    message = catalog_error(catalog_copy)
    assert "phases.yaml" in message
    assert "phase-1.mix[0].cuont" in message


def test_missing_required_field_names_file_and_field(catalog_copy):
    edit_entry(catalog_copy / "phases.yaml", "phase-3", "  epochs: 5\n", "")
    message = catalog_error(catalog_copy)
    assert "phases.yaml" in message
    assert "phase-3.epochs" in message
    assert "missing" in message


def test_dataset_naming_an_unknown_source(catalog_copy):
    replace_once(catalog_copy / "datasets.yaml", "{source: journeydb,", "{source: journeydbb,")
    message = catalog_error(catalog_copy)
    assert "datasets.yaml" in message
    assert "journeydb.source" in message
    assert "'journeydbb'" in message


def test_phase_naming_an_unknown_dataset(catalog_copy):
    edit_entry(
        catalog_copy / "phases.yaml", "phase-4", "{dataset: vggface2,", "{dataset: vgg-face2,"
    )
    message = catalog_error(catalog_copy)
    assert "phases.yaml" in message
    assert "phase-4.mix[0].dataset" in message
    assert "'vgg-face2'" in message


def test_out_of_range_value_names_file_field_and_value(catalog_copy):
    edit_entry(
        catalog_copy / "phases.yaml", "phase-4", "  cfg_dropout: 0.15\n", "  cfg_dropout: 1.5\n"
    )
    message = catalog_error(catalog_copy)
    assert "phases.yaml" in message
    assert "phase-4.cfg_dropout" in message
    assert "1.5" in message


def test_a_phase_trains_on_one_node_unless_it_says_more(catalog, catalog_copy):
    assert {p.nodes for p in catalog.phases.values()} == {1}
    edit_entry(
        catalog_copy / "phases.yaml",
        "phase-4",
        "  cfg_dropout: 0.15\n",
        "  cfg_dropout: 0.15\n  nodes: 0\n",
    )
    assert "phase-4.nodes: out of range, got 0" in catalog_error(catalog_copy)


def test_unknown_phase_lookup_names_the_phase_and_the_choices(catalog):
    with pytest.raises(CatalogError) as info:
        catalog.phase("9")
    message = str(info.value)
    assert "\n" not in message
    assert "phases.yaml" in message
    assert "'phase-9'" in message
    assert "phase-7" in message  # the names the user can pick from


def test_catalog_dir_from_environment(catalog_copy, monkeypatch):
    edit_entry(catalog_copy / "phases.yaml", "demo", "  lr: 1.0e-3\n", "  lr: 2.0e-3\n")
    monkeypatch.setenv("SDPIPE_CATALOG", str(catalog_copy))
    assert load_catalog().phase("demo").lr == 2e-3
