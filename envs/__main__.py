"""What data an environment would run on here, for evolve.sh to record and check before it starts:

    python -m envs data alfworld     # official | generated   (ALFWorld's games, or ours: envs/alfworld_gen.py)
    python -m envs data webshop      # real | mini            (WebShop's own site and products, or the bundled shop)
    python -m envs data sciworld     # scienceworld           (the real engine, the only one)

`--why` prints, for a stand-in, one line saying what is missing and how to get the real thing.
"""
from __future__ import annotations

import sys


def data_source(env: str) -> tuple[str, str]:
    """(what the adapter would run on, and for a stand-in what the real data needs)."""
    if env == "sciworld":
        return "scienceworld", ""
    if env == "alfworld":
        from envs.alfworld import AlfWorldEnv
        if AlfWorldEnv().official:
            return "official", ""
        return "generated", ("ALFWorld's official games are missing: set ALFWORLD_DATA to the folder that holds "
                             "json_2.1.1/ (`alfworld-download` fetches them to ~/.cache/alfworld; docs/real-data.md)")
    if env == "webshop":
        from envs.webshop import real_webshop
        if real_webshop() is not None:
            return "real", ""
        return "mini", ("WebShop is missing or did not start: install web_agent_site with its product data and "
                        "search index (github.com/princeton-nlp/WebShop, setup.sh; docs/real-data.md)")
    raise SystemExit(f"unknown env {env!r}; use one of sciworld, alfworld, webshop")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) not in (2, 3) or args[0] != "data" or args[2:] not in ([], ["--why"]):
        sys.exit("usage: python -m envs data ENV [--why]")
    kind, why = data_source(args[1])
    print(why if "--why" in args else kind)
