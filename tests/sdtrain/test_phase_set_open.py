"""Issue 26.5: every rank opens the phase set; opening it lists its token links once instead of
a stat per link (10,000 shards on NFS, on every rank)."""

from __future__ import annotations

from pathlib import Path


def test_a_phase_set_open_stats_no_token_link(phase_dir, monkeypatch):
    from sdtrain.data import PhaseSet

    asked: list[Path] = []
    exists = Path.exists

    def counted(self, *args, **kwargs):
        asked.append(self)
        return exists(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(Path, "exists", counted)
        data = PhaseSet(phase_dir)
    assert [p for p in asked if p.parent.name == "tokens"] == []
    assert len(data) == 32 and data[0][1].shape == (77,)
