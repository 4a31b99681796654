"""GPU pool settings and the secret mask, without a server."""

from __future__ import annotations

import logging

from flows.execution import credentials, pools


def test_gpu_pool_limit_name_and_slots(monkeypatch):
    monkeypatch.setenv("SDPIPE_GPU_POOL", "A100 Node.7")
    assert pools.gpu_limit_name() == "sdpipe-gpu-a100-node-7"
    monkeypatch.delenv("SDPIPE_GPU_POOL")
    assert pools.gpu_limit_name().startswith("sdpipe-gpu-")  # the host name
    monkeypatch.setenv("SDPIPE_GPU_SLOTS", "8")
    assert pools.gpu_slots() == 8
    monkeypatch.delenv("SDPIPE_GPU_SLOTS")
    assert pools.gpu_slots() == max(1, pools.local_gpus())


def test_env_secret_is_masked_in_every_handler(monkeypatch):
    token = "wandb-0123456789abcdef"
    monkeypatch.setenv("WANDB_API_KEY", token)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    logger = logging.getLogger("sdpipe-test-secrets")
    handler = Keep()
    logger.addHandler(handler)
    try:
        assert "WANDB_API_KEY" in credentials.export_secrets(("WANDB_API_KEY",))
        logger.warning("key=%s", token)
        try:
            raise RuntimeError(f"401 for {token}")
        except RuntimeError:
            logger.exception("login failed")
    finally:
        logger.removeHandler(handler)
    text = "\n".join(records)
    assert token not in text
    assert "key=********" in text and "401 for ********" in text


def test_missing_servers_give_a_reason_to_skip(monkeypatch):
    from flows.cli import broker, postgres

    monkeypatch.setattr(postgres, "bin_dir", lambda: None)
    assert "apt-get install postgresql" in postgres.unavailable_reason()
    monkeypatch.setattr(broker.shutil, "which", lambda name: None)
    assert "apt-get install redis-server" in broker.unavailable_reason()
