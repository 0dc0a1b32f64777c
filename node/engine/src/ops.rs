//! Small f32 kernels of the trunk, written to follow llama.cpp's CPU arithmetic.

/// Whether `a` and `b` hold the same values bit for bit (what a swarm's or a drafted run's
/// logits must be against a local, undrafted one).
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// `rms(x, w) = x / sqrt(mean(x²) + eps) * w` for each row of `w.len()` values (sum in f64, as
/// ggml does).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm_in_place(&mut out, w, eps);
    out
}

/// [`rms_norm`] in place.
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for row in x.chunks_exact_mut(n) {
        let sum: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
        let scale = 1.0 / ((sum / n as f64) as f32 + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

/// NEOX RoPE of one head vector at position `pos`: pairs `(i, i + d/2)` rotate by
/// `pos · base^(-2i/d)` (the angle advanced by repeated multiplication, as ggml does).
pub fn rope_neox(v: &mut [f32], pos: usize, base: f32) {
    let d = v.len();
    let half = d / 2;
    let theta_scale = base.powf(-2.0 / d as f32);
    let mut theta = pos as f32;
    for i in 0..half {
        let (sin, cos) = theta.sin_cos();
        let (a, b) = (v[i], v[i + half]);
        v[i] = a * cos - b * sin;
        v[i + half] = a * sin + b * cos;
        theta *= theta_scale;
    }
}

/// Softmax in place (max subtracted, sum in f64).
pub fn softmax_in_place(v: &mut [f32]) {
    let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for x in v.iter_mut() {
        *x = (*x - max).exp();
        sum += *x as f64;
    }
    let inv = (1.0 / sum) as f32;
    for x in v.iter_mut() {
        *x *= inv;
    }
}

/// Dot product of two f32 slices.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_at_zero_is_identity_and_preserves_norm() {
        let mut v: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let orig = v.clone();
        rope_neox(&mut v, 0, 10_000.0);
        assert_eq!(v, orig);
        rope_neox(&mut v, 13, 10_000.0);
        let n = |x: &[f32]| x.iter().map(|a| a * a).sum::<f32>();
        assert!((n(&v) - n(&orig)).abs() < 1e-3);
        // First pair rotates by exactly `pos` radians.
        let mut e = vec![0.0f32; 16];
        e[0] = 1.0;
        rope_neox(&mut e, 2, 10_000.0);
        assert!((e[0] - 2f32.cos()).abs() < 1e-6 && (e[8] - 2f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn rms_norm_makes_unit_rms() {
        let x = [3.0f32, -4.0, 0.0, 5.0];
        let y = rms_norm(&x, &[1.0; 4], 0.0);
        let rms = (y.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6);
    }
}
