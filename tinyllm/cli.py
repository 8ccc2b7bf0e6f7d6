"""What the command-line scripts share: their --help formatter.

argparse's ArgumentDefaultsHelpFormatter appends "(default: ...)" to every option's help, also where the help says
the default in words already or the default is None (meaning "decided later"): "(default: SmolLM2-135M-Instruct)
(default: None)". This one appends it only where it adds something.
"""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
