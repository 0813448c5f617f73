"""Data for data-parallel training: partitioning, distributed sampling, datasets.

Everything here takes the rank and world size as plain integers; nothing talks to a
process group.
"""

from ddptrain.data.datasets import (
    DATASET_NAMES,
    DatasetCorruptError,
    DatasetNotFoundError,
    SyntheticClassification,
    build_dataset,
    fashion_mnist,
    mnist,
    prepare_dataset_files,
    resolve_data_root,
)
from ddptrain.data.partition import DataPartitioner, Partition, partition_dataset
from ddptrain.data.sampler import DistributedSampler

__all__ = [
    "DATASET_NAMES",
    "DataPartitioner",
    "DatasetCorruptError",
    "DatasetNotFoundError",
    "DistributedSampler",
    "Partition",
    "SyntheticClassification",
    "build_dataset",
    "fashion_mnist",
    "mnist",
    "partition_dataset",
    "prepare_dataset_files",
    "resolve_data_root",
]
