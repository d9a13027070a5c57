"""The study's three groups: the one definition that the runner, the analysis and the app read.

GPT-Base (standard Q/K), OELM-NoFreeze (orthogonal Q/K, trained) and OELM-Freeze (orthogonal Q/K,
frozen), in the order tables, figures and the demo's columns list them. A leaf module: it imports
nothing of the package, so that anything may import it.
"""

GROUP_LABELS = {"gpt_base": "GPT-Base", "oelm_nofreeze": "OELM-NoFreeze", "oelm_freeze": "OELM-Freeze"}
GROUPS = tuple(GROUP_LABELS)
BASELINE = "gpt_base"
