"""What the pipeline knows of a target model: its folder (modeldir.py: config, checkpoint, wrapper layout),
its checkpoint's headers and MoE routing keys (checkpoint.py), its decoder layers and which of them are
captured (layers.py), the scale profile of their states (layer_profile.py), a spot re-computation of stored
states from the model (recompute.py), the draft's vocabulary mapping to the target's (vocab.py) and the
parameters one token meets (experts.py). Imports no stage."""
