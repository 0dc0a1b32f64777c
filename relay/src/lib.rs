//! relay
