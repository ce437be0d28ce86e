"""The values of ``model.template_check`` (what a chat template that fails the token-in-token-out
probe does: stop the run, or warn and go on; rollout/template_renderer.py).

Its own dependency-free module so that the config checks (rl/config_checks.py) and the renderer
read one tuple, and loading a config does not import the renderer's tokenizer stack.
"""

TEMPLATE_CHECKS = ("error", "warn")
