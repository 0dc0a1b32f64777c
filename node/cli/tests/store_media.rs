//! A store on media that cannot take writes: read-only media is read (and nothing in it is
//! changed), a full disk is an error that moves nothing (the index is not taken for a corrupt
//! one). Each case runs in a mount namespace of its own (`unshare -m`), so its mounts vanish
//! with its last process, even when the test is killed.

use moeswarm_testkit as common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use common::data;

fn moeswarm(args: &[&str]) -> (i32, String, String) {
    common::run_program(env!("CARGO_BIN_EXE_moeswarm"), args)
}

/// Runs `script` with `sh` in a fresh mount namespace (at most 5 minutes); `$M` is the
/// `moeswarm` binary, `$1`… are `args`. Exit code and stdout + stderr together.
fn in_mount_namespace(script: &str, args: &[&str]) -> (i32, String) {
    let out = Command::new("timeout")
        .args([
            "300",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
        ])
        .arg(script)
        .arg("sh")
        .args(args)
        .env("M", env!("CARGO_BIN_EXE_moeswarm"))
        .output()
        .expect("running unshare (util-linux)");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// Every path under `dir` with its length and modification time.
fn listing(dir: &Path) -> BTreeSet<(String, u64, std::time::SystemTime)> {
    let mut out = BTreeSet::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            if m.is_dir() {
                todo.push(e.path());
            }
            let name = e.path().strip_prefix(dir).unwrap().display().to_string();
            out.insert((name, m.len(), m.modified().unwrap()));
        }
    }
    out
}

/// Slices `model` into `store`, returning the model id.
fn sliced(model: &Path, store: &Path) -> String {
    let (code, out, err) = moeswarm(&[
        "slice",
        "--store",
        store.to_str().unwrap(),
        model.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["model_id"].as_str().unwrap().to_string()
}

#[test]
fn a_store_on_read_only_media_generates_the_same_tokens_and_nothing_in_it_changes() {
    let dir = tempfile::tempdir().unwrap();
    let (store, ro) = (dir.path().join("store"), dir.path().join("ro"));
    std::fs::create_dir(&ro).unwrap();
    let model = sliced(&data("tiny-f32.gguf"), &store);
    let generate = [
        "--model-id",
        &model,
        "--prompt",
        "the swarm",
        "--max-tokens",
        "8",
    ];
    let mut args = vec!["generate", "--store", store.to_str().unwrap()];
    args.extend(generate);
    let (code, expected, err) = moeswarm(&args);
    assert_eq!(code, 0, "{err}");
    let before = listing(&store);

    // The same store mounted read-only: generate reads it; scrub says what it is; a slice
    // into it is refused by name.
    let script = r#"mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" || exit 90
        echo "== generate"; "$M" generate --store "$2" --model-id "$3" --prompt "the swarm" \
            --max-tokens 8 2>/dev/null; echo "== rc $?"
        echo "== scrub"; "$M" scrub --store "$2" 2>&1; echo "== rc $?"
        echo "== slice"; "$M" slice --store "$2" "$4" 2>&1; echo "== rc $?""#;
    let tiny8 = data("tiny-q8_0.gguf");
    let (code, text) = in_mount_namespace(
        script,
        &[
            store.to_str().unwrap(),
            ro.to_str().unwrap(),
            &model,
            tiny8.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{text}");
    let part = |name: &str| {
        let from = text.find(&format!("== {name}\n")).expect(&text) + name.len() + 4;
        text[from..].split("== rc ").next().unwrap().to_string()
    };
    let rc = |name: &str| {
        let from = text.find(&format!("== {name}\n")).expect(&text);
        text[from..].split("== rc ").nth(1).unwrap()[..1].to_string()
    };
    assert_eq!(rc("generate"), "0", "{text}");
    assert_eq!(part("generate"), expected, "{text}");
    assert_eq!(rc("scrub"), "0", "{text}");
    assert!(
        part("scrub").contains("the store is read-only") && part("scrub").contains("0 that do not"),
        "{text}"
    );
    assert_eq!(rc("slice"), "2", "{text}");
    assert!(
        part("slice").contains("is read-only") && part("slice").contains("not written to"),
        "{text}"
    );
    assert_eq!(listing(&store), before, "the read-only store changed");
}

#[test]
fn a_full_disk_is_an_error_that_moves_nothing_and_the_store_opens_once_there_is_room() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    // A 24 MiB disk with a sliced model on it, filled to the last byte.
    let script = r#"mount -t tmpfs -o size=24m moeswarm-test "$1" || exit 90
        "$M" slice --store "$1/store" "$2" >/dev/null 2>&1 || exit 91
        dd if=/dev/zero of="$1/fill" bs=4k 2>/dev/null
        echo "== full"; "$M" scrub --store "$1/store" 2>&1; echo "== rc $?"
        echo "== entries"; ls "$1/store"
        rm "$1/fill"
        echo "== room"; "$M" scrub --store "$1/store" --json 2>&1; echo "== rc $?""#;
    let model = data("small-q4_k.gguf");
    let (code, text) =
        in_mount_namespace(script, &[disk.to_str().unwrap(), model.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    let section = |name: &str| {
        let from = text.find(&format!("== {name}\n")).expect(&text) + name.len() + 4;
        text[from..].split("== ").next().unwrap().to_string()
    };
    let full = section("full");
    assert!(
        full.contains("is full") && full.contains("nothing in the store was moved"),
        "{text}"
    );
    assert!(text.contains("== rc 2"), "a full disk is an error: {text}");
    let entries = section("entries");
    assert!(
        !entries.contains("index.unreadable"),
        "the index was moved aside: {text}"
    );
    assert!(entries.lines().any(|l| l == "index"), "{text}");
    // With room again, the same index opens: every blob verified, none adopted.
    let room = section("room");
    let v: serde_json::Value = serde_json::from_str(room.trim()).expect(&text);
    assert_eq!(v["adopted"], 0, "{text}");
    assert!(v["index_rebuilt"].is_null(), "{text}");
    assert!(v["blobs_ok"].as_u64().unwrap() > 0, "{text}");
}
