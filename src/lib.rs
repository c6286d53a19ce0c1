//! kev
