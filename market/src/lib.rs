//! market
