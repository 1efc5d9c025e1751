"""The data model, no GPU: weight types, the prepacked layout (prepack, unpack, shard),
quantization, save/load, and stacked experts."""
