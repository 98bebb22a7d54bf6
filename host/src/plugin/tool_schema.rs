//! A tool's parameter schema, checked when its component loads: it must be
//! JSON, a JSON Schema the validator compiles, and describe one JSON object
//! (the models pass a tool's arguments as one object, and the providers
//! refuse any other top-level type). A tool whose schema fails is refused at
//! load with the reason, rather than sent to the model as something else.

use serde_json::Value;

/// Why a tool's parameter schema is refused.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error("is not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    #[error(
        "must describe one JSON object, as {{\"type\": \"object\", \"properties\": {{...}}}}; \
         its top level {0}"
    )]
    NotAnObject(&'static str),
    #[error("is not a valid JSON Schema: {0}")]
    Invalid(String),
    #[error("is {bytes} bytes, over the limit of {MAX_SCHEMA_BYTES} bytes")]
    TooLarge { bytes: usize },
    #[error("has {count} regular expressions (`pattern`, `patternProperties`), over the limit of {MAX_PATTERNS}")]
    TooManyPatterns { count: usize },
}

/// The largest schema a tool may declare. Real ones are a few KiB; the cap
/// bounds what compiling one costs the host at load.
pub const MAX_SCHEMA_BYTES: usize = 64 << 10;
/// The most regular expressions one schema may hold; each is compiled at
/// load, within [`MAX_REGEX_BYTES`].
pub const MAX_PATTERNS: usize = 64;
/// The most memory one compiled regular expression may take.
const MAX_REGEX_BYTES: usize = 256 << 10;

/// Refuses every `$ref` to outside the schema: dexa fetches nothing, whatever
/// features the validator was built with elsewhere.
struct NoFetch;

impl jsonschema::Retrieve for NoFetch {
    fn retrieve(
        &self,
        uri: &jsonschema::Uri<String>,
    ) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
        Err(format!("{uri} is outside the schema, and dexa fetches nothing").into())
    }
}

/// The longest part of a validator's message kept in an error (a hostile
/// schema could make it as long as itself).
const MAX_REASON_BYTES: usize = 512;

/// Checks `schema` and returns it parsed.
pub fn check(schema: &str) -> Result<Value, SchemaError> {
    if schema.len() > MAX_SCHEMA_BYTES {
        return Err(SchemaError::TooLarge {
            bytes: schema.len(),
        });
    }
    let value: Value = serde_json::from_str(schema).map_err(SchemaError::NotJson)?;
    let Value::Object(object) = &value else {
        return Err(SchemaError::NotAnObject("is not a JSON object"));
    };
    match object.get("type") {
        Some(Value::String(kind)) if kind == "object" => {}
        Some(_) => {
            return Err(SchemaError::NotAnObject(
                "has a \"type\" other than \"object\"",
            ))
        }
        None => return Err(SchemaError::NotAnObject("has no \"type\"")),
    }
    // The meta-schema first: it names the keyword that is wrong. Compiling
    // then catches what it cannot (a bad `pattern`, a `$ref` to nowhere or
    // outside the schema, which is never fetched).
    jsonschema::meta::validate(&value).map_err(|err| invalid(&err))?;
    let count = patterns(&value);
    if count > MAX_PATTERNS {
        return Err(SchemaError::TooManyPatterns { count });
    }
    jsonschema::options()
        .with_retriever(NoFetch)
        .with_pattern_options(
            jsonschema::PatternOptions::fancy_regex()
                .size_limit(MAX_REGEX_BYTES)
                .dfa_size_limit(MAX_REGEX_BYTES),
        )
        .build(&value)
        .map_err(|err| invalid(&err))?;
    Ok(value)
}

/// How many regular expressions `value` holds: every string `pattern` and
/// every key of a `patternProperties` (counted wherever they sit, which
/// over-counts a property named so: the cap is generous).
fn patterns(value: &Value) -> usize {
    match value {
        Value::Object(object) => object
            .iter()
            .map(|(key, inner)| {
                let own = match (key.as_str(), inner) {
                    ("pattern", Value::String(_)) => 1,
                    ("patternProperties", Value::Object(keys)) => keys.len(),
                    _ => 0,
                };
                own + patterns(inner)
            })
            .sum(),
        Value::Array(items) => items.iter().map(patterns).sum(),
        _ => 0,
    }
}

fn invalid(err: &jsonschema::ValidationError<'_>) -> SchemaError {
    let path = err.instance_path().to_string();
    let mut reason = if path.is_empty() {
        err.to_string()
    } else {
        format!("at {path}: {err}")
    };
    if reason.len() > MAX_REASON_BYTES {
        let mut end = MAX_REASON_BYTES;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
        reason.push('…');
    }
    SchemaError::Invalid(reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_schema_with_properties_passes() {
        let schema = r#"{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}"#;
        assert!(check(schema).is_ok());
        assert!(check(r#"{"type":"object"}"#).is_ok());
        // What real tools declare: patterns, formats, enums, nested objects,
        // local references.
        let real = r##"{"$schema":"https://json-schema.org/draft/2020-12/schema","type":"object",
            "properties":{"slug":{"type":"string","pattern":"^[a-z0-9-]{1,64}$"},
              "email":{"type":"string","pattern":"^\\w+@\\w+\\.\\w{2,}$","format":"email"},
              "when":{"type":"string","format":"date-time"},
              "mode":{"enum":["fast","slow"]},
              "items":{"type":"array","items":{"$ref":"#/$defs/item"},"maxItems":10}},
            "$defs":{"item":{"type":"object","properties":{"n":{"type":"integer","minimum":0}}}},
            "required":["slug"],"additionalProperties":false}"##;
        assert!(check(real).is_ok(), "{:?}", check(real));
        let draft7 = r#"{"$schema":"http://json-schema.org/draft-07/schema#","type":"object","properties":{"a":{"type":"string"}}}"#;
        assert!(check(draft7).is_ok(), "{:?}", check(draft7));
    }

    #[test]
    fn a_schema_that_is_not_json_is_refused() {
        for bad in ["", "{", "not json", "{\"type\":\"object\"} trailing"] {
            assert!(
                matches!(check(bad), Err(SchemaError::NotJson(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_schema_for_anything_but_one_object_is_refused() {
        for bad in [
            "[]",
            "true",
            "{}",
            r#"{"type":"string"}"#,
            r#"{"type":["object","null"]}"#,
        ] {
            assert!(
                matches!(check(bad), Err(SchemaError::NotAnObject(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn an_invalid_schema_is_refused_with_the_keyword_that_is_wrong() {
        let err = check(r#"{"type":"object","properties":{"n":{"type":"integr"}}}"#)
            .expect_err("an unknown type is refused");
        let text = err.to_string();
        assert!(text.contains("/properties/n/type"), "{text}");
        for bad in [
            r#"{"type":"object","required":"n"}"#,
            r#"{"type":"object","properties":{"n":{"minimum":"one"}}}"#,
            r#"{"type":"object","properties":{"s":{"type":"string","pattern":"(["}}}"#,
            r#"{"type":"object","properties":{"r":{"$ref":"https://example.com/schema.json"}}}"#,
            r##"{"type":"object","properties":{"r":{"$ref":"#/$defs/missing"}}}"##,
        ] {
            assert!(matches!(check(bad), Err(SchemaError::Invalid(_))), "{bad}");
        }
    }

    #[test]
    fn a_schema_too_large_or_with_too_many_patterns_is_refused_before_compiling() {
        let big = format!(
            r#"{{"type":"object","description":"{}"}}"#,
            "x".repeat(MAX_SCHEMA_BYTES)
        );
        assert!(matches!(check(&big), Err(SchemaError::TooLarge { .. })));
        let properties: Vec<String> = (0..=MAX_PATTERNS)
            .map(|n| format!(r#""p{n}":{{"type":"string","pattern":"^\\w{{300}}{n}$"}}"#))
            .collect();
        let many = format!(
            r#"{{"type":"object","properties":{{{}}}}}"#,
            properties.join(",")
        );
        assert!(
            matches!(check(&many), Err(SchemaError::TooManyPatterns { count }) if count == MAX_PATTERNS + 1),
            "{:?}",
            check(&many)
        );
    }

    #[test]
    fn a_regular_expression_too_costly_to_compile_is_refused() {
        let schema = r#"{"type":"object","properties":{"s":{"type":"string","pattern":"\\w{1000}\\w{1000}\\w{1000}"}}}"#;
        assert!(
            matches!(check(schema), Err(SchemaError::Invalid(_))),
            "{:?}",
            check(schema)
        );
    }

    #[test]
    fn a_long_reason_is_cut() {
        let name = "x".repeat(10_000);
        let schema = format!(r#"{{"type":"object","properties":{{"n":{{"type":"{name}"}}}}}}"#);
        let err = check(&schema).expect_err("refused");
        assert!(err.to_string().len() < MAX_REASON_BYTES + 100, "{err}");
    }
}
