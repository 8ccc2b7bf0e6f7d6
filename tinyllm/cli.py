"""What the command-line scripts share: their --help formatter, and matplotlib for their pictures.

argparse's ArgumentDefaultsHelpFormatter appends "(default: ...)" to every option's help, also where the help says
the default in words already or the default is None (meaning "decided later"): "(default: SmolLM2-135M-Instruct)
(default: None)". This one appends it only where it adds something.
"""
from __future__ import annotations

import argparse
import sys


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def pyplot(hint: str = ""):
    """matplotlib.pyplot drawing to files (no window), or exit with a one-line error saying what to install."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(f"error: the PNG needs matplotlib: pip install -e \".[viz]\"{hint}")
    return plt
