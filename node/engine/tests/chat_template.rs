//! Real Qwen chat templates (Qwen3.5's and Qwen3's, from llama.cpp's template collection)
//! rendered here equal Python jinja2's rendering as transformers does it
//! (`data/templates/rendered.json`, `scripts/chat_reference.py`), tools and tool calls included.

use minijinja::Value;
use moeswarm_engine::text::chat::{ChatError, ChatInputs, ChatTemplate, TemplateOrigin};
use moeswarm_testkit::data;

fn reference() -> Value {
    // Read as minijinja values straight from the text: keys keep the order they were written in.
    serde_json::from_slice(&std::fs::read(data("templates/rendered.json")).unwrap()).unwrap()
}

fn template(name: &str) -> ChatTemplate {
    let source = std::fs::read_to_string(data(&format!("templates/{name}"))).unwrap();
    ChatTemplate::new(&source, "", "<|im_end|>", TemplateOrigin::Model).unwrap()
}

fn inputs(conv: &Value) -> ChatInputs {
    let get = |k: &str| conv.get_attr(k).ok().filter(|v| !v.is_undefined());
    ChatInputs {
        messages: get("messages").unwrap(),
        tools: get("tools"),
        add_generation_prompt: get("add_generation_prompt").is_none_or(|v| v.is_true()),
        extra: get("enable_thinking")
            .map(|v| vec![("enable_thinking".to_string(), v)])
            .unwrap_or_default(),
    }
}

#[test]
fn qwen_templates_render_as_jinja2_does() {
    let r = reference();
    let conversations = r.get_attr("conversations").unwrap();
    let rendered = r.get_attr("rendered").unwrap();
    let mut n = 0;
    for name in ["Qwen3.5-4B.jinja", "Qwen-Qwen3-0.6B.jinja"] {
        let t = template(name);
        let want = rendered.get_attr(name).unwrap();
        for key in conversations.try_iter().unwrap() {
            let conv = conversations.get_item(&key).unwrap();
            let got = t
                .render(&inputs(&conv))
                .unwrap_or_else(|e| panic!("{name} {key}: {e}"));
            let want = want.get_item(&key).unwrap();
            assert_eq!(got, want.as_str().unwrap(), "{name}: {key}");
            n += 1;
        }
    }
    assert_eq!(n, 14);
}

#[test]
fn a_template_that_refuses_its_inputs_says_why() {
    let t = template("Qwen3.5-4B.jinja");
    // Qwen3.5's template wants a user query and a system turn only first.
    let e = t
        .render(&ChatInputs::turns([("assistant", "hi")]))
        .unwrap_err();
    assert!(
        matches!(&e, ChatError::Render(m) if m.contains("No user query found in messages.")),
        "{e}"
    );
    let e = t
        .render(&ChatInputs::turns([("user", "a"), ("system", "b")]))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("System message must be at the beginning."),
        "{e}"
    );
}
