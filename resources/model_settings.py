"""Where the base model and its tokenizer come from: the engine's ``BaseModelConfig`` as a
resource (the tokenizer and base_model assets share it; ``COMPOSER_BASE_MODEL`` and
``COMPOSER_MODEL_CONFIG`` set it in ``definitions.py``)."""

from composer_dag.train.model import BaseModelConfig
from resources.base import ClearConfigResource
from resources.dagster_config import dagster_config

ModelSettings = dagster_config(BaseModelConfig, base=ClearConfigResource, name="ModelSettings", module=__name__)
