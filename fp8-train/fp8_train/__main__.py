"""`python -m fp8_train` (or `fp8-train`):

python -m fp8_train [hydra overrides]            train one run (recipe=..., see conf/config.yaml)
python -m fp8_train -m recipe=fp32,emulated_delayed seed=0,1     a Hydra sweep of runs
python -m fp8_train inspect RUN [key=value ...]  rank the worst layers from the FP8 debug records
python -m fp8_train dashboard RUN [RUN...]       training-health dashboard (PNG + HTML)
python -m fp8_train compare [options] [overrides]  high precision vs FP8 recipes over seeds
"""

from __future__ import annotations

import sys

from dtrain.core.errors import UserError, fail
from dtrain.run.app import hydra_main

# named, not imported: a wrong override is refused before torch and the rank code load
# (dtrain.run.app.resolve)
train_main = hydra_main(
    "fp8_train.conf",
    rank_fn="fp8_train.train:rank_fn",
    validate="fp8_train.checks:validate",
    finalize="fp8_train.train:finalize",
)


def _tool(name: str):
    if name == "inspect":
        from fp8_train.inspect import main as tool
    elif name == "dashboard":
        from fp8_train.dashboard import main as tool
    else:
        from fp8_train.compare import main as tool
    return tool


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("inspect", "dashboard", "compare"):
        tool, argv = _tool(sys.argv[1]), sys.argv[2:]
        try:
            tool(argv)
        except (UserError, FileNotFoundError) as e:
            fail(str(e), 2)
        return
    train_main()


if __name__ == "__main__":
    main()
