"""What the stages are built from: params read once and typed (``params``, ``configs``, with the values one key
derives for another), the table of artefact paths (``paths``), MLflow runs (``runs``), staged outputs
(``outputs``), resume checkpoints (``resume``), launching processes (``launch``), the skeleton of the training
stages (``stage``), the scalar-model training the reward and judge stages share (``scalar``), backbones
(``backbones``), the registry library (``registry``), the champion's folder and the model card. Nothing here is a
stage or a command."""
