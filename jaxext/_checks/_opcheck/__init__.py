"""``jaxext.opcheck`` and its checks."""

from ._entry import CHECK_NAMES as CHECK_NAMES
from ._entry import opcheck as opcheck
