"""Images for vision-language models: where they come from and what the engine is given.

`media.py` turns an image URL (data:, file:// under --allowed-local-media-path, http(s)) into checked
bytes and decodes them with PIL within pixel and byte limits; `processor.py` runs the model's Hugging
Face processor (its PIL path: no torchvision) over the prompt text and the images and returns
`inputs.MultiModalInputs`: the expanded prompt ids, each image's encoder inputs, content hash and
placeholder positions (`families.py` knows each architecture's pixel layout); `embedding_cache.py`
keeps encoded images by content hash. Imports nothing of loraserve but `config`, `envs` and `errors`.
"""
