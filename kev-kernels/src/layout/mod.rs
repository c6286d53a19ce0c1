//! How the ops' inputs lie in memory: evenly spaced rows ([`rows`]) and the split of a packed
//! batch into records' states and their branches ([`split`]).

pub(crate) mod rows;
pub(crate) mod split;
