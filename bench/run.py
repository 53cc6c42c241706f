"""Run the lorabus benchmark from a checkout: the same as ``lorabus bench``.

    .venv/bin/python bench/run.py --quick --out bench/results/quick.json
    .venv/bin/python bench/run.py --out bench/results/$(date +%F)-full.json

Options: ``python bench/run.py --help``. Each run's JSON belongs in
``bench/results/`` so that a regression shows in review.
"""

from __future__ import annotations

import sys

from lorabus.cli.main import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]], prog_name="bench/run.py")
