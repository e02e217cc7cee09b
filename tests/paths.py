"""Where the repository, the shared GSM8K copy and MaxText's installed base.yml live, for tests and their scripts."""

import os
import pathlib

from maxtext.configs import pyconfig

REPO = pathlib.Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
MAXTEXT_BASE_YML = os.path.join(pyconfig.MAXTEXT_CONFIGS_DIR, "base.yml")
BUNDLED_CONFIGS = REPO / "maxtext_posttrain" / "configs"
