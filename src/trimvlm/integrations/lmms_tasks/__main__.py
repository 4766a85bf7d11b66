"""Print the folder of trimvlm's local-copy lmms-eval tasks (for `--include_path`)."""

from trimvlm.integrations.lmms_tasks import FOLDER

print(FOLDER)
