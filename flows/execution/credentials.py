"""Secrets (HF token for gated datasets, W&B key): from the environment, else from a Prefect
Secret block; never from a file in the repository, and never in a log line.

| variable        | Secret block     | used by                                          |
|-----------------|------------------|--------------------------------------------------|
| `HF_TOKEN`      | `hf-token`       | huggingface_hub / datasets (gated sources)       |
| `WANDB_API_KEY` | `wandb-api-key`  | the trainer when a run asks for W&B              |

`export_secrets()` runs at the start of the flows: it puts each value it finds into this
flow-run process's environment (libraries read them from there; torchrun's ranks inherit it)
and installs a logging filter that replaces every known secret value with `********` in every
log record of the process, the records sent to the Prefect API included. Create a block with
`python -c "from prefect.blocks.system import Secret; Secret(value='...').save('hf-token')"`
or in the dashboard (Blocks -> Secret).
"""

from __future__ import annotations

import logging
import os

SECRETS = {"HF_TOKEN": "hf-token", "WANDB_API_KEY": "wandb-api-key"}
MASK = "********"
_known: set[str] = set()


def read_secret(env_name: str, block_name: str | None = None) -> str | None:
    """The value of `env_name` in the environment, else of the Secret block, else None."""
    if value := os.environ.get(env_name):
        return value
    block_name = block_name or SECRETS.get(env_name)
    if not block_name:
        return None
    try:
        from prefect.blocks.system import Secret

        value = Secret.load(block_name, _sync=True).get()
    except Exception:  # no block of that name, or no server: the secret is just not set
        return None
    return str(value) if value else None


def export_secrets(names: tuple[str, ...] = tuple(SECRETS)) -> list[str]:
    """Resolve each secret into the environment and redact it from logs; returns the names set."""
    found = []
    for name in names:
        value = read_secret(name)
        if value:
            os.environ[name] = value
            redact(value)
            found.append(name)
    return found


def redact(value: str) -> None:
    """Mask `value` in every log record from now on (values shorter than 4 are not secrets)."""
    if len(value) >= 4:
        _known.add(value)
    install_filter()


def scrub(text: str) -> str:
    for value in sorted(_known, key=len, reverse=True):
        text = text.replace(value, MASK)
    return text


class RedactSecrets(logging.Filter):
    """Rewrites a record's message (and traceback) with every known secret masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _known:
            return True
        message = record.getMessage()
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        return True


_FILTER = RedactSecrets()


def install_filter() -> None:
    """Attach the filter to every handler there is (Prefect's API and console handlers too).

    A handler's filters see every record that reaches it, whichever logger it came from.
    """
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
