"""Hydra, in one place: the schema, the config package, composing, and ``hydra.main``.

The schema is ddptrain's dataclasses (:class:`ddptrain.config.Config`), registered in Hydra's
``ConfigStore`` as ``ddptrain_schema`` and listed first in ``conf/config.yaml``'s defaults: Hydra
validates every value against it and the YAML files hold only what an option changes. The
configs ship inside the package (``ddptrain.conf``, a link to the repository's ``conf/``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from ..config import Config
from .overrides import config_dirs_of, flags_first, override_tokens

CONFIG_MODULE = "ddptrain.conf"
SCHEMA_NAME = "ddptrain_schema"


def package_config_dir() -> Path:
    """Where ddptrain's own YAML files are (inside the installed package)."""
    import ddptrain.conf

    return Path(ddptrain.conf.__file__).resolve().parent


def config_dirs(argv: Sequence[str]) -> list[Path]:
    """ddptrain's config directory and the user's ``--config-dir`` ones."""
    return config_dirs_of(argv, package_config_dir())


def register_schema() -> None:
    """Make the dataclasses Hydra's schema (idempotent)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


def compose_config(argv: Sequence[str], with_hydra: bool = False) -> DictConfig:
    """Compose the config the command line asks for, without running anything; ``with_hydra``
    keeps Hydra's own node (``hydra.run.dir``...), as ``hydra.main`` would see it.

    Raises:
        hydra.errors.HydraException: an override Hydra refuses (a value of the wrong type...).
    """
    register_schema()
    tokens = override_tokens(argv)
    overrides = [t for t in tokens if with_hydra or not t.lstrip("+~").startswith(("hydra.", "hydra/"))]
    extra = [d.resolve().as_uri() for d in config_dirs(argv)[1:]]
    if extra:
        overrides.append(f"hydra.searchpath=[{','.join(extra)}]")
    with initialize_config_module(CONFIG_MODULE, version_base="1.3", job_name="ddptrain"):
        return compose(config_name=_config_name(argv), overrides=overrides, return_hydra_config=with_hydra)


def help_text(argv: Sequence[str], options: dict[str, list[str]]) -> str:
    """``--help``: ``hydra.help.template`` of ``conf/config.yaml`` with its config groups
    (``options``) and the config composed from ``argv``, as Hydra prints it, without starting
    Hydra's application (a tenth of the time).

    Raises:
        hydra.errors.HydraException: the arguments do not compose.
    """
    cfg = compose_config(argv, with_hydra=True)
    template = str(cfg.hydra.help.template)
    with open_dict(cfg):
        del cfg["hydra"]
    groups = "".join(f"{group}: {', '.join(names)}\n" for group, names in sorted(options.items()))
    return template.replace("$APP_CONFIG_GROUPS", groups).replace("$CONFIG", OmegaConf.to_yaml(cfg))


def _config_name(argv: Sequence[str]) -> str:
    for flag, value in zip(argv, list(argv[1:]) + [""]):
        if flag in ("--config-name", "-cn"):
            return value
    return "config"


def to_config(cfg: DictConfig, output_dir: str | None) -> Config:
    """The composed config as ddptrain's dataclasses, with Hydra's run directory as output dir."""
    data: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    data.pop("hydra", None)
    trainer = data.setdefault("trainer", {})
    if not trainer.get("output_dir") and output_dir:
        trainer["output_dir"] = output_dir
    return Config.from_dict(data)


def run_hydra_main(argv: Sequence[str], task: Callable[[DictConfig, str, bool], None]) -> None:
    """Hand the command line to ``hydra.main`` (run directory, ``--cfg``, ``--help``, ``-m`` sweeps);
    ``task(cfg, run_dir, is_sweep)`` runs once per job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    def hydra_task(cfg: DictConfig) -> None:
        hydra_cfg = HydraConfig.get()
        task(cfg, hydra_cfg.runtime.output_dir, hydra_cfg.mode == RunMode.MULTIRUN)

    register_schema()
    sys.argv = [sys.argv[0], *flags_first(argv)]  # a flag anywhere, as a user writes it
    hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")(hydra_task)()
