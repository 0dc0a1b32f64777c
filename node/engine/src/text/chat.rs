//! Chat prompts: a conversation rendered by the model's own `tokenizer.chat_template` (Jinja),
//! as transformers and llama.cpp render it.
//!
//! The template runs on `minijinja` with Python's string and dict methods (`startswith`,
//! `split`, `items`, …), `trim_blocks` and `lstrip_blocks` on, `raise_exception`, and
//! transformers' `tojson` (Python's `json.dumps`, not HTML-escaped) and Python's `string` of
//! booleans and none. Its inputs are transformers' names: `messages`, `tools`,
//! `add_generation_prompt`, `bos_token`, `eos_token`, and any extra keyword the caller passes
//! (`enable_thinking`, …). A model without a template gets ChatML when its vocabulary has
//! ChatML's markers, and no chat otherwise. This module renders text; it does not tokenize.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind};

/// ChatML, for models whose vocabulary has its markers but whose file has no template.
pub const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// Why a conversation could not be made into a prompt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatError {
    /// The model has no template and its vocabulary no ChatML markers.
    #[error(
        "the model has no chat template (tokenizer.chat_template) and its vocabulary has no \
         ChatML markers: use completions, or give a template (--chat-template FILE)"
    )]
    NoTemplate,
    /// The template is not valid Jinja.
    #[error("the chat template does not compile: {0}")]
    Compile(String),
    /// The template failed on these inputs (its own `raise_exception` included).
    #[error("the chat template failed to render: {0}")]
    Render(String),
}

/// Where a template came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateOrigin {
    /// The model's `tokenizer.chat_template`.
    Model,
    /// Given by the user (`--chat-template`).
    Given,
    /// ChatML, the model having none but ChatML's markers.
    ChatMl,
}

/// What a template is rendered with.
#[derive(Debug, Clone, Default)]
pub struct ChatInputs {
    /// The conversation: a list of messages (`role`, `content`, `tool_calls`, …).
    pub messages: Value,
    /// Tools the model may call (OpenAI's `tools`), if any.
    pub tools: Option<Value>,
    /// End with the opening of the assistant's turn.
    pub add_generation_prompt: bool,
    /// More keyword inputs (`enable_thinking`, …), as llama.cpp's `chat_template_kwargs`.
    pub extra: Vec<(String, Value)>,
}

impl ChatInputs {
    /// A conversation of `(role, content)` turns, ready for the assistant's turn.
    pub fn turns<'a>(turns: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let messages: Vec<Value> = turns
            .into_iter()
            .map(|(role, content)| {
                Value::from_iter([
                    ("role", Value::from(role)),
                    ("content", Value::from(content)),
                ])
            })
            .collect();
        Self {
            messages: Value::from(messages),
            add_generation_prompt: true,
            ..Self::default()
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// Where it came from.
    pub origin: TemplateOrigin,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

fn raise_exception(message: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// Python's `str()` of a value (`True`, `None`), for the `string` filter.
fn py_string(v: Value) -> Value {
    match v.kind() {
        ValueKind::Bool => Value::from(if v.is_true() { "True" } else { "False" }),
        ValueKind::None | ValueKind::Undefined => Value::from("None"),
        ValueKind::String => v,
        _ => Value::from(v.to_string()),
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos` and `eos` are the texts the template may insert.
    pub fn new(
        source: &str,
        bos: &str,
        eos: &str,
        origin: TemplateOrigin,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_filter("string", py_string);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ChatError::Compile(describe(&e)))?;
        Ok(Self {
            env,
            bos: bos.to_string(),
            eos: eos.to_string(),
            origin,
        })
    }

    /// Renders the prompt for `inputs`.
    pub fn render(&self, inputs: &ChatInputs) -> Result<String, ChatError> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Compile(describe(&e)))?;
        let mut ctx: Vec<(String, Value)> = inputs.extra.clone();
        ctx.push(("messages".into(), inputs.messages.clone()));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(inputs.add_generation_prompt),
        ));
        ctx.push(("bos_token".into(), Value::from(self.bos.as_str())));
        ctx.push(("eos_token".into(), Value::from(self.eos.as_str())));
        if let Some(tools) = &inputs.tools {
            ctx.push(("tools".into(), tools.clone()));
        }
        t.render(Value::from_iter(ctx))
            .map_err(|e| ChatError::Render(describe(&e)))
    }
}

/// A Jinja error in one line: its kind and detail, and the template line when known.
fn describe(e: &JinjaError) -> String {
    let mut s = match e.detail() {
        Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_string(),
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    };
    if let Some(line) = e.line() {
        s += &format!(" (template line {line})");
    }
    s
}

/// transformers' `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=…,
/// separators=…, sort_keys=…)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators {
        Some(s) => {
            let a = s.get_item_by_index(0)?.as_str().map(str::to_string);
            let b = s.get_item_by_index(1)?.as_str().map(str::to_string);
            match (a, b) {
                (Some(a), Some(b)) => (a, b),
                _ => {
                    return Err(JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be two strings",
                    ))
                }
            }
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = JsonStyle {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonStyle {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
}

impl JsonStyle {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    }

    fn write(&self, v: &Value, level: usize, out: &mut String) -> Result<(), JinjaError> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => match (v.as_i64(), f64::try_from(v.clone())) {
                (Some(i), _) if v.is_integer() => out.push_str(&i.to_string()),
                (_, Ok(f)) => out.push_str(&py_float(f)),
                _ => out.push_str(&v.to_string()),
            },
            ValueKind::String => {
                out.push_str(&serde_json::to_string(v.as_str().unwrap_or("")).unwrap_or_default())
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container('[', ']', items.len(), level, out, |i, out| {
                    self.write(&items[i], level + 1, out)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                self.container('{', '}', keys.len(), level, out, |i, out| {
                    let k = &keys[i];
                    let name = k.as_str().map_or_else(|| k.to_string(), str::to_string);
                    out.push_str(&serde_json::to_string(&name).unwrap_or_default());
                    out.push_str(&self.key);
                    self.write(&v.get_item(k)?, level + 1, out)
                })?;
            }
            _ => out.push_str(&serde_json::to_string(&v.to_string()).unwrap_or_default()),
        }
        Ok(())
    }

    fn container(
        &self,
        open: char,
        close: char,
        n: usize,
        level: usize,
        out: &mut String,
        mut item: impl FnMut(usize, &mut String) -> Result<(), JinjaError>,
    ) -> Result<(), JinjaError> {
        out.push(open);
        if n == 0 {
            out.push(close);
            return Ok(());
        }
        for i in 0..n {
            if i > 0 {
                out.push_str(&self.item);
            }
            self.newline(level + 1, out);
            item(i, out)?;
        }
        self.newline(level, out);
        out.push(close);
        Ok(())
    }
}

/// Python's `repr` of a float: shortest round trip, `.0` on whole numbers, exponents of at
/// least two digits with a sign, past 1e16 or below 1e-4.
fn py_float(f: f64) -> String {
    if !f.is_finite() {
        return if f.is_nan() {
            "NaN"
        } else if f > 0.0 {
            "Infinity"
        } else {
            "-Infinity"
        }
        .into();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let s = format!("{f:e}");
        let (m, e) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
        return format!("{m}e{sign}{digits:0>2}");
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        s + ".0"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_does() {
        for (f, want) in [
            (1.0, "1.0"),
            (2.5, "2.5"),
            (-0.001, "-0.001"),
            (1e-7, "1e-07"),
            (1.5e20, "1.5e+20"),
            (0.1, "0.1"),
        ] {
            assert_eq!(py_float(f), want);
        }
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}",
            "",
            "",
            TemplateOrigin::Given,
        )
        .unwrap();
        let x: Value =
            serde_json::from_str(r#"{"b": [1, 2.5, true, null], "a": "<é\n>", "e": {}}"#).unwrap();
        let out = t
            .render(&ChatInputs {
                extra: vec![("x".into(), x)],
                ..ChatInputs::default()
            })
            .unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, true, null], \"a\": \"<é\\n>\", \"e\": {}}|{\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"a\": \"<é\\n>\",\n  \"e\": {}\n}"
        );
    }

    #[test]
    fn a_template_error_is_named() {
        let t = ChatTemplate::new(
            "{{ raise_exception('no system role here') }}",
            "",
            "",
            TemplateOrigin::Given,
        )
        .unwrap();
        let e = t.render(&ChatInputs::turns([("system", "x")])).unwrap_err();
        assert_eq!(
            e,
            ChatError::Render("no system role here (template line 1)".into())
        );
        let e = ChatTemplate::new("{% if %}", "", "", TemplateOrigin::Given).unwrap_err();
        assert!(matches!(e, ChatError::Compile(_)), "{e}");
    }

    #[test]
    fn chatml_renders_turns() {
        let t = ChatTemplate::new(CHATML, "", "", TemplateOrigin::ChatMl).unwrap();
        let out = t
            .render(&ChatInputs::turns([
                ("system", "Be brief."),
                ("user", "hi"),
            ]))
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
