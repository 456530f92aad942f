"""The code of a registered version's MLflow Model (models from code): MLflow runs this file to build the model;
:class:`tasks.kit.served.ServedModel` loads the safetensors folder in ``load_context``. Nothing is pickled."""

from mlflow.models import set_model

from tasks.kit.served import ServedModel

set_model(ServedModel())
