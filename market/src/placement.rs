//! Slab placement: every slab on `R` distinct devices, no device over its RAM budget, and the
//! expected routing load spread in proportion to what each device can take.
//!
//! Greedy and deterministic: slabs in order of decreasing load (then size, then id), each
//! replica to the device that holds the least load per unit of capability among those with
//! room that do not hold the slab yet. Phones count as a quarter of a computer's capability,
//! so hot experts go to computers first.

use serde::Serialize;

/// A device that can hold slabs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Device {
    /// Its name, as the user wrote it.
    pub name: String,
    /// Bytes of RAM it gives to slabs.
    pub ram_bytes: u64,
    /// Phones compute slower and sleep: they get a smaller share of load.
    pub phone: bool,
}

/// Capability weight of a phone relative to a computer.
pub const PHONE_WEIGHT: f64 = 0.25;

impl Device {
    fn capability(&self) -> f64 {
        let w = if self.phone { PHONE_WEIGHT } else { 1.0 };
        w * self.ram_bytes.max(1) as f64
    }
}

/// One slab to place.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SlabDemand {
    /// Layer index.
    pub layer: u32,
    /// Expert index.
    pub expert: u32,
    /// Bytes.
    pub bytes: u64,
    /// Expected share of routing that lands on it (any non-negative scale).
    pub load: f64,
}

/// Where every replica went.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Placement {
    /// Replicas per slab.
    pub replicas: u32,
    /// `holders[i]`: device indices holding `slabs[i]`.
    pub holders: Vec<Vec<usize>>,
    /// Bytes placed on each device.
    pub bytes_per_device: Vec<u64>,
    /// Load placed on each device (each replica carries `load / replicas`).
    pub load_per_device: Vec<f64>,
}

/// Why no placement exists.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlacementError {
    /// Fewer devices than replicas.
    #[error("{replicas} replicas need {replicas} devices, only {devices} given")]
    TooFewDevices {
        /// Replicas asked for.
        replicas: u32,
        /// Devices given.
        devices: usize,
    },
    /// Not enough RAM in all: `shortfall` more bytes are needed.
    #[error("short of {shortfall} bytes: {needed} needed for all replicas, {available} available")]
    Shortfall {
        /// Bytes all replicas need.
        needed: u64,
        /// Bytes all devices give.
        available: u64,
        /// `needed - available`, or what was left unplaced when RAM is fragmented.
        shortfall: u64,
    },
    /// A slab larger than every device.
    #[error(
        "slab layer {layer} expert {expert} ({bytes} bytes) fits on fewer than {replicas} devices"
    )]
    SlabTooLarge {
        /// Layer.
        layer: u32,
        /// Expert.
        expert: u32,
        /// Its bytes.
        bytes: u64,
        /// Replicas asked for.
        replicas: u32,
    },
}

/// Places `replicas` copies of every slab on `devices`.
pub fn place(
    slabs: &[SlabDemand],
    devices: &[Device],
    replicas: u32,
) -> Result<Placement, PlacementError> {
    let r = replicas as usize;
    if devices.len() < r {
        return Err(PlacementError::TooFewDevices {
            replicas,
            devices: devices.len(),
        });
    }
    let needed: u64 = slabs
        .iter()
        .map(|s| s.bytes.saturating_mul(replicas as u64))
        .sum();
    let available: u64 = devices.iter().map(|d| d.ram_bytes).sum();
    if needed > available {
        return Err(PlacementError::Shortfall {
            needed,
            available,
            shortfall: needed - available,
        });
    }
    for s in slabs {
        if devices.iter().filter(|d| d.ram_bytes >= s.bytes).count() < r {
            return Err(PlacementError::SlabTooLarge {
                layer: s.layer,
                expert: s.expert,
                bytes: s.bytes,
                replicas,
            });
        }
    }
    let mut order: Vec<usize> = (0..slabs.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (&slabs[a], &slabs[b]);
        y.load
            .total_cmp(&x.load)
            .then(y.bytes.cmp(&x.bytes))
            .then((x.layer, x.expert).cmp(&(y.layer, y.expert)))
    });
    let mut holders = vec![Vec::with_capacity(r); slabs.len()];
    let mut used = vec![0u64; devices.len()];
    let mut load = vec![0f64; devices.len()];
    let mut unplaced = 0u64;
    for i in order {
        let s = &slabs[i];
        let share = s.load / replicas.max(1) as f64;
        for _ in 0..r {
            let best = (0..devices.len())
                .filter(|&d| !holders[i].contains(&d) && devices[d].ram_bytes - used[d] >= s.bytes)
                .min_by(|&a, &b| {
                    let key = |d: usize| {
                        // Load per capability, then fullness, then index: deterministic.
                        let c = devices[d].capability();
                        (
                            (load[d] + share) / c,
                            (used[d] + s.bytes) as f64 / devices[d].ram_bytes.max(1) as f64,
                        )
                    };
                    let (ka, kb) = (key(a), key(b));
                    ka.0.total_cmp(&kb.0)
                        .then(ka.1.total_cmp(&kb.1))
                        .then(a.cmp(&b))
                });
            match best {
                Some(d) => {
                    holders[i].push(d);
                    used[d] += s.bytes;
                    load[d] += share;
                }
                None => unplaced += s.bytes,
            }
        }
    }
    if unplaced > 0 {
        return Err(PlacementError::Shortfall {
            needed,
            available,
            shortfall: unplaced,
        });
    }
    Ok(Placement {
        replicas,
        holders,
        bytes_per_device: used,
        load_per_device: load,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn devices() -> impl Strategy<Value = Vec<Device>> {
        proptest::collection::vec((1u64..400, any::<bool>()), 1..8).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (ram, phone))| Device {
                    name: format!("d{i}"),
                    ram_bytes: ram * 10,
                    phone,
                })
                .collect()
        })
    }

    fn slabs() -> impl Strategy<Value = Vec<SlabDemand>> {
        proptest::collection::vec((1u64..40, 0.0f64..1.0), 1..60).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (bytes, load))| SlabDemand {
                    layer: (i / 8) as u32,
                    expert: (i % 8) as u32,
                    bytes,
                    load,
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn a_placement_keeps_every_rule(s in slabs(), d in devices(), r in 1u32..4) {
            match place(&s, &d, r) {
                Ok(p) => {
                    for (i, h) in p.holders.iter().enumerate() {
                        prop_assert_eq!(h.len(), r as usize, "slab {} has {:?}", i, h);
                        let mut u = h.clone();
                        u.sort();
                        u.dedup();
                        prop_assert_eq!(u.len(), h.len(), "a device holds slab {} twice", i);
                    }
                    for (di, dev) in d.iter().enumerate() {
                        let bytes: u64 = p.holders.iter().zip(&s)
                            .filter(|(h, _)| h.contains(&di)).map(|(_, s)| s.bytes).sum();
                        prop_assert_eq!(bytes, p.bytes_per_device[di]);
                        prop_assert!(bytes <= dev.ram_bytes);
                    }
                    prop_assert_eq!(place(&s, &d, r).unwrap(), p, "not deterministic");
                }
                Err(PlacementError::Shortfall { needed, available, shortfall }) => {
                    prop_assert!(shortfall > 0);
                    prop_assert!(needed > available || shortfall <= needed);
                }
                Err(PlacementError::TooFewDevices { .. }) => prop_assert!(d.len() < r as usize),
                Err(PlacementError::SlabTooLarge { bytes, .. }) => {
                    prop_assert!(d.iter().filter(|x| x.ram_bytes >= bytes).count() < r as usize)
                }
            }
        }

        #[test]
        fn plenty_of_room_always_places(s in slabs(), r in 1u32..4) {
            let total: u64 = s.iter().map(|x| x.bytes).sum();
            let d: Vec<Device> = (0..r + 1).map(|i| Device { name: format!("{i}"), ram_bytes: total, phone: false }).collect();
            prop_assert!(place(&s, &d, r).is_ok());
        }
    }

    #[test]
    fn equal_computers_share_uniform_load_evenly_and_phones_get_less() {
        let s: Vec<SlabDemand> = (0..64)
            .map(|e| SlabDemand {
                layer: 0,
                expert: e,
                bytes: 10,
                load: 1.0,
            })
            .collect();
        let mk = |phone| Device {
            name: String::new(),
            ram_bytes: 10_000,
            phone,
        };
        let p = place(&s, &[mk(false), mk(false), mk(false), mk(false)], 2).unwrap();
        assert!(
            p.load_per_device.iter().all(|&l| (l - 16.0).abs() < 1e-9),
            "{:?}",
            p.load_per_device
        );
        let p = place(&s, &[mk(false), mk(false), mk(true)], 2).unwrap();
        assert!(
            p.load_per_device[2] < p.load_per_device[0] / 2.0,
            "{:?}",
            p.load_per_device
        );
    }

    #[test]
    fn shortfall_is_reported_in_bytes() {
        let s = vec![
            SlabDemand {
                layer: 0,
                expert: 0,
                bytes: 100,
                load: 1.0
            };
            3
        ];
        let d = vec![
            Device {
                name: "a".into(),
                ram_bytes: 250,
                phone: false,
            },
            Device {
                name: "b".into(),
                ram_bytes: 10,
                phone: false,
            },
        ];
        assert_eq!(
            place(&s, &d, 2),
            Err(PlacementError::Shortfall {
                needed: 600,
                available: 260,
                shortfall: 340
            })
        );
    }
}
