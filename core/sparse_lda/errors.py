"""Errors raised by the sparse LDA maths.

Every input problem is a ``ValueError`` subclass so callers can catch the whole family,
and every message names the party, column and first offending row when they apply.
"""


class SparseLDAInputError(ValueError):
    """Base class for bad input to the sparse LDA estimators."""


class DimensionLimitError(SparseLDAInputError):
    """The number of features is above what the dense LP solver handles in reasonable time."""


class MissingClassError(SparseLDAInputError):
    """Too few rows of one class to estimate the mean difference: at a party, for a local
    fit; over all parties (from the released counts), for the pooled row-level fit."""


class LabelValueError(SparseLDAInputError):
    """Labels are not the two expected class codes."""


class ColumnMismatchError(SparseLDAInputError):
    """Parties disagree on the feature columns, so their estimates cannot be averaged."""


class NonFiniteValueError(SparseLDAInputError):
    """A feature holds NaN or infinity, which would silently poison every estimate."""


class ShapeError(SparseLDAInputError):
    """Arrays have the wrong number of dimensions or inconsistent lengths."""


class InfeasibleProgramError(ValueError):
    """The L1 linear program has no feasible point: its constraint radius is too small."""


class PrivacySettingsError(ValueError):
    """Privacy parameters are out of range or inconsistent with the number of parties."""


class DegenerateDataError(SparseLDAInputError):
    """No usable column or class anywhere: a site's columns are all constant within classes,
    a class is missing at every site, or a column is degenerate at every site."""


class ContributionError(ValueError):
    """A party's vector for the secure sum is not finite or exceeds the bound it must meet;
    the party is refused by name and its vector never enters the sum."""
