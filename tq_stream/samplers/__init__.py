"""Samplers: which ready rows form the next step of a task."""

from tq_stream.samplers.base import Candidates, Sampler, Selection
from tq_stream.samplers.dynamic_filter import DynamicFilterSampler
from tq_stream.samplers.group import GroupSampler
from tq_stream.samplers.partition import PartitionSampler
from tq_stream.samplers.priority import PrioritySampler
from tq_stream.samplers.seqlen_balanced import SeqlenBalancedSampler
from tq_stream.samplers.sequential import SequentialSampler
from tq_stream.samplers.staleness import StalenessSampler, admission_limit

__all__ = [
    "Candidates",
    "DynamicFilterSampler",
    "GroupSampler",
    "PartitionSampler",
    "PrioritySampler",
    "Sampler",
    "Selection",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "StalenessSampler",
    "admission_limit",
]
