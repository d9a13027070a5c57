"""OELM Lab web demo (Gradio): ``python -m app`` serves GPT-Base, OELM-NoFreeze and OELM-Freeze
side by side (see ``app.demo``)."""

import os

# No analytics or version check: the demo runs on machines without internet access.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
