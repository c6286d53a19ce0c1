//! kev-candle
