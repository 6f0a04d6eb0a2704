"""`specheads export`: self-describing head folders (safetensors + config + model card) and Hub repos."""
